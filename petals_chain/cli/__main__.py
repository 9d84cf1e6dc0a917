import sys

from petals_chain.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
