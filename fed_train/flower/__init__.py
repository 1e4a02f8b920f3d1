"""The Flower deployment: a ClientApp and a ServerApp that run the same algorithms' client and
server halves as the simulation, over a real SuperLink and SuperNodes. Needs the `flower` extra
(`pip install "knnper[flower]"`); nothing else in the package imports it."""
