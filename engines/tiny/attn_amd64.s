//go:build !purego

#include "textflag.h"

// Attention's weighted sums, 16 columns (two ymm registers) at a time: each element keeps its own
// sum over positions, in order of position, with every product rounded before it is added
// (VMULPS then VADDPS), as the Go loops of attendRow and attentionBackward compute it.

// func attnOut16(out, p, v *float32, stride uintptr, n, groups int)
// out[c] = Σ_s p[s]·v[s·stride + c] for c < 16·groups (stride in bytes), starting from +0.
TEXT ·attnOut16(SB), NOSPLIT, $0-48
	MOVQ out+0(FP), DI
	MOVQ p+8(FP), SI
	MOVQ v+16(FP), DX
	MOVQ stride+24(FP), R8
	MOVQ n+32(FP), R9
	MOVQ groups+40(FP), R10

group:
	TESTQ R10, R10
	JZ done
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	MOVQ SI, R11 // p
	MOVQ DX, R12 // row of v
	MOVQ R9, CX
	TESTQ CX, CX
	JZ store

pos:
	VBROADCASTSS (R11), Y2
	VMULPS (R12), Y2, Y3
	VADDPS Y3, Y0, Y0
	VMULPS 32(R12), Y2, Y4
	VADDPS Y4, Y1, Y1
	ADDQ $4, R11
	ADDQ R8, R12
	DECQ CX
	JNZ pos

store:
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	ADDQ $64, DI
	ADDQ $64, DX
	DECQ R10
	JMP group

done:
	VZEROUPPER
	RET

// func attnGradRow16(n int, cs, p, keys, dk, dv *float32, stride uintptr, q, do, dq *float32, groups int)
// For one query row: dq[c] = Σ_j cs[j]·keys[j][c] (from +0), and for each j in order
// dk[j][c] += cs[j]·q[c], dv[j][c] += p[j]·do[c]; rows j are stride bytes apart.
TEXT ·attnGradRow16(SB), NOSPLIT, $0-88
	MOVQ groups+80(FP), R13
	XORQ R14, R14 // byte offset of the group

group:
	TESTQ R13, R13
	JZ done
	MOVQ n+0(FP), CX
	MOVQ cs+8(FP), SI
	MOVQ p+16(FP), BX
	MOVQ keys+24(FP), R8
	MOVQ dk+32(FP), R9
	MOVQ dv+40(FP), R10
	MOVQ stride+48(FP), R11
	MOVQ q+56(FP), AX
	MOVQ do+64(FP), DX
	ADDQ R14, R8
	ADDQ R14, R9
	ADDQ R14, R10
	VMOVUPS (AX)(R14*1), Y4 // q
	VMOVUPS 32(AX)(R14*1), Y5
	VMOVUPS (DX)(R14*1), Y6 // do
	VMOVUPS 32(DX)(R14*1), Y7
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	TESTQ CX, CX
	JZ store

pos:
	VBROADCASTSS (SI), Y2 // cs[j]
	VBROADCASTSS (BX), Y3 // p[j]
	VMULPS (R8), Y2, Y8
	VADDPS Y8, Y0, Y0
	VMULPS 32(R8), Y2, Y9
	VADDPS Y9, Y1, Y1
	VMULPS Y4, Y2, Y10
	VADDPS (R9), Y10, Y10
	VMOVUPS Y10, (R9)
	VMULPS Y5, Y2, Y11
	VADDPS 32(R9), Y11, Y11
	VMOVUPS Y11, 32(R9)
	VMULPS Y6, Y3, Y12
	VADDPS (R10), Y12, Y12
	VMOVUPS Y12, (R10)
	VMULPS Y7, Y3, Y13
	VADDPS 32(R10), Y13, Y13
	VMOVUPS Y13, 32(R10)
	ADDQ $4, SI
	ADDQ $4, BX
	ADDQ R11, R8
	ADDQ R11, R9
	ADDQ R11, R10
	DECQ CX
	JNZ pos

store:
	MOVQ dq+72(FP), DI
	VMOVUPS Y0, (DI)(R14*1)
	VMOVUPS Y1, 32(DI)(R14*1)
	ADDQ $64, R14
	DECQ R13
	JMP group

done:
	VZEROUPPER
	RET
