"""rollout-capture's NeMo Gym model server: the server ``serves`` names, captured by ours.

NeMo Gym runs this file (``gym env start``, its folder found through ``--search-dir``); its
workers import it (``num_workers`` > 1). See rollout_capture.producer.nemo_gym and docs/nemo-gym.md.
"""

from rollout_capture.producer.nemo_gym import run, worker_app

if __name__ == "__main__":
    run()
else:
    app = worker_app(__file__)
