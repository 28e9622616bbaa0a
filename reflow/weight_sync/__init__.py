from reflow.weight_sync.broadcast import SyncPlan, WeightSync, build_sync_plan

__all__ = ["SyncPlan", "WeightSync", "build_sync_plan"]
