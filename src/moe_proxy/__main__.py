import sys

from moe_proxy.cli import main

sys.exit(main())
