"""Where admitted work waits: the bounded weighted-fair queue and its overflow policies,
the dispatcher that hands work to the scheduler when it has room, and the journal of
background jobs."""
