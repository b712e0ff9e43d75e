"""What crosses between processes: messages, serialization, framing, lanes, call bookkeeping."""
