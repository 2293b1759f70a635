"""``python -m kvdaemon``: the same command line as the ``kvdaemon`` script."""

from kvdaemon.cli import main

if __name__ == "__main__":
    main(prog_name="kvdaemon")
