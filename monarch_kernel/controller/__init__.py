"""The controller, in the notebook's process: its loop thread, the state of ranks and hosts, routing."""
