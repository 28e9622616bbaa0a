from reflow.config.job_config import JobConfig
from reflow.config.manager import ConfigError, ConfigManager, format_config

__all__ = ["ConfigError", "ConfigManager", "JobConfig", "format_config"]
