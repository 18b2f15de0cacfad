"""Load generation and measurement: slow readers, disconnects, overload."""
