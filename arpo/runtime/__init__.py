"""What every run stands on, whatever it trains: seeding, logging and the console, the metrics tracker, the machine
record, Ray start-up and GPU placement, and a fast exit once the results are written."""
