"""``python -m arpo.tables``: the tables command (implementation: :mod:`arpo.evaluation.tables`)."""

from arpo.evaluation.tables import main

if __name__ == "__main__":
    main()
