"""`python -m lazarus.reference`: write the docs site's reference pages (or --check them)."""

import sys

from lazarus.reference.pages import main

sys.exit(main())
