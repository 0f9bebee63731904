import sys

from actors.daemon_cli import main

sys.exit(main())
