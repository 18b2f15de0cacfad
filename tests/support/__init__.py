"""What tests share: servers in a process of their own or in the test's own event loop,
and the rule that keeps process-starting tests out of ``make test-fast``."""
