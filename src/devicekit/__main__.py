"""``python -m devicekit ...`` is the ``devicekit`` command."""

from devicekit.cli.main import main

if __name__ == "__main__":
    main()
