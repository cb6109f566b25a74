"""``python -m ccexp.report``: the comparison report of a sweep (see [`ccexp.tracking.report`][ccexp.tracking.report])."""
from ccexp.tracking.report import main

if __name__ == "__main__":
    main()
