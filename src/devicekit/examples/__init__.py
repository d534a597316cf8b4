"""The bundled example training job that ``devicekit run`` runs when given no command.

May import: every wing (it is a front door, like ``cli``); nothing imports it.

Usage::

    python -m devicekit.examples --seconds 2
    devicekit run                     # the same, on the device devicekit picks and leases

    from devicekit.examples.train import train
    print(train(seconds=1).steps_per_second)
"""
