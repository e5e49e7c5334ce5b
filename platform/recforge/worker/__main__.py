"""`python -m recforge.worker SPEC_JSON`: one training rank (recforge.worker.main)."""
import sys

from recforge.worker.main import main

sys.exit(main())
