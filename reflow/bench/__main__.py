import sys

from reflow.bench.modes import main

if __name__ == "__main__":
    sys.exit(main())
