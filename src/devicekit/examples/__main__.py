"""``python -m devicekit.examples``: run the bundled example training (see ``train.py``)."""

import sys

from devicekit.examples.train import main

sys.exit(main())
