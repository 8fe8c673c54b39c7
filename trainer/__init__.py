"""cloudrl: the PPO trainer that runs on a Ray cluster."""
