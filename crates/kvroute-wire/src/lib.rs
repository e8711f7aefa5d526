//! kvroute-wire (being written).
