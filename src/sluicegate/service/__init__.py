"""A request's life from the front door to the engine and back: the service that joins
admission, the queue and the engine core, and moves each generation to its end once."""
