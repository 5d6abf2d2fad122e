import sys

from stabstudy.run.cli import main

sys.exit(main())
