"""What several test modules share and is not a fixture: models, faults, helpers (imported as
``support.<module>``: pytest puts the ``tests`` folder on ``sys.path``, and multiprocessing
hands that path on to spawned ranks and to the fork server)."""
