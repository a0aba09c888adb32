//go:build !purego

package tiny

// attnOut16 sets out[c] = Σ_s p[s]·v[s·stride/4 + c] over s < n, for c < 16·groups (stride in
// bytes), each sum in order of s from +0.
//
//go:noescape
func attnOut16(out, p, v *float32, stride uintptr, n, groups int)

// attnGradRow16 is one query row of attention's backward pass: dq[c] = Σ_j cs[j]·keys[j][c] (from
// +0), and for each j in order dk[j][c] += cs[j]·q[c] and dv[j][c] += p[j]·do[c], over c <
// 16·groups; keys, dk and dv rows are stride bytes apart.
//
//go:noescape
func attnGradRow16(n int, cs, p, keys, dk, dv *float32, stride uintptr, q, do, dq *float32, groups int)
