"""Procedural shapes: the dataset the shipped tiny models are trained on, the judge that scores
what they draw, and the training that makes them (`stepserve train-shapes`)."""
