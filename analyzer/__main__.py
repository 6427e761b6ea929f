"""`python -m analyzer FILE ...` is `analyze FILE ...`."""
import sys

from analyzer.commands import main

sys.exit(main())
