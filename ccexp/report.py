"""``python -m ccexp.report``: the comparison report of a sweep (see [`ccexp.compare.report`][ccexp.compare.report])."""
from ccexp.compare.report import main

if __name__ == "__main__":
    from ccexp.runtime import run_command

    run_command(main)
