"""What several test modules build the same way (tiny bundles, tiny federations, the bench
table at digits scale): test modules import these, never one another."""
