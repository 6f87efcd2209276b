"""`python -m mooncake_server` is the same as the `mooncake-server` console script."""

from mooncake_server.cli import main

if __name__ == "__main__":
    main()
