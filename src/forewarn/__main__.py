import sys

from forewarn.cli import main

sys.exit(main())
