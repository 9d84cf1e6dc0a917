"""A serving process's life: the asyncio loop thread, signals and forked DHT children, the start-up heap."""
