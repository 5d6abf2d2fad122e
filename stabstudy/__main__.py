import sys

from stabstudy.cli import main

sys.exit(main())
