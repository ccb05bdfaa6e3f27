import sys

from prefix_router.cli import main

sys.exit(main())
