package kernels

import "fmt"

// The order of a forward launch's (batch element, head) pairs.
//
// Every forward launch numbers its pairs l = 0 … B·H − 1 (the grid's y + z
// plane, cta_order's pair, or the persistent schedule's section slots) and
// runs the pairs' tiles in that order, so the pairs with neighbouring
// numbers run at the same time. Batch-major (l = b·H + h, the heads of one
// batch element together) is the order of every variant. A bias shared by
// the batch ([1, H|1, N, M]: its batch stride is 0) is read by each of the
// B pairs of a head, a query block's rows of it per CTA; head-major
// (l = h·B + b) runs those B CTAs together, so that they read each bias
// tile at once and share it in L2 rather than fetching it from DRAM B
// times. A bias variant reads the stride at run time: a bias of every
// batch element keeps the batch-major order.

// pairOrder returns, for a bias variant, the statements that set b and h
// (set batch-major by the caller's statements before them) head-major from
// pair number l when the bias is shared by the batch, each line after
// indent; nothing for other variants.
func (x *gen) pairOrder(indent, l string) string {
	if x.v.Bias == BiasNone {
		return ""
	}
	return fmt.Sprintf(`%[1]sif (p.bias_sb == 0) {  // a bias the batch shares: a head's batch elements together (kernels/fwd_pair_order.go)
%[1]s  b = (int)(%[2]s) %% p.b;
%[1]s  h = (int)(%[2]s) / p.b;
%[1]s}
`, indent, l)
}
