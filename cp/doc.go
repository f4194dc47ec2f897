// Package cp runs attention with context parallelism: the sequence of one
// attention problem is split across the P ranks of a communication group,
// each rank holding a shard of Q, K and V, and the ranks exchange K/V blocks
// or heads so that together they compute exactly what one device would.
package cp
