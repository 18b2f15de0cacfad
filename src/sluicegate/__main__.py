from __future__ import annotations

from sluicegate.cli import main

main()
