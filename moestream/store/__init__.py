"""Where expert weights live: the provider interface, resident experts, (later) the on-disk store."""
