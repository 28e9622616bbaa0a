import sys

from reflow.bench import agents, generation, lora, modes, placement, resize, sandbox, trainer

BENCHMARKS = {"agents": agents.main, "generation": generation.main, "lora": lora.main,
              "modes": modes.main, "placement": placement.main, "resize": resize.main,
              "sandbox": sandbox.main, "trainer": trainer.main}

if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what not in BENCHMARKS:
        print(f"usage: python -m reflow.bench {{{','.join(BENCHMARKS)}}} [options]   (--help after the name)", file=sys.stderr)
        sys.exit(2)
    sys.exit(BENCHMARKS[what]())
