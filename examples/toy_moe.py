"""The toy MoE training (same as ``python -m ep_plugin demo``); run: python examples/toy_moe.py --ranks 4."""

import sys

from ep_plugin.demo import main

if __name__ == "__main__":
    sys.exit(main())
