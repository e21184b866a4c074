"""``python -m arpo.eval``: the evaluation command (implementation: :mod:`arpo.evaluation.evaluate`)."""

from arpo.evaluation.evaluate import main

if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
