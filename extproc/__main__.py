import sys

from extproc.cli import main

sys.exit(main())
