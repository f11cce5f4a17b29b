"""The operations console's data: the runtime's status as the console shows it."""
