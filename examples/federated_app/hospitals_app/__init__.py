"""A consortium's Flower app: federated P3SGD with lightning-dp (patient-level DP across hospitals)."""
