"""``python -m devicekit.examples``: run the bundled example training (see ``train.py``).

The process ends without the interpreter's teardown once the work is done (see
:mod:`devicekit.parallel.clean_exit`): a finished job never aborts at exit.
"""

from devicekit.examples.train import main
from devicekit.parallel.clean_exit import exit_without_teardown

exit_without_teardown(main())
