"""What every other package stands on: settings (config), one-line user errors (errors), the
device and precision (device), random states (rng), the progress helper (progress), the tests'
fault switches (inject), and atomic saves and safe loads (checkpoint)."""
