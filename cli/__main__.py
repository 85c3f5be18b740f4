"""``python -m rollout_capture.cli``: the command line, as the ``rollout-capture`` script runs it."""

from rollout_capture.cli.app import main

if __name__ == "__main__":  # importing it (pkgutil.walk_packages, docs) runs nothing
    main()
