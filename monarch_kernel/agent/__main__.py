"""`python -m monarch_kernel.agent`: run a host agent."""

from monarch_kernel.agent.cli import main

if __name__ == "__main__":
    main()
