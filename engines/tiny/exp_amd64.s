//go:build !purego

#include "textflag.h"

// func expBlocks(dst, src *float64, n int, c *[12]float64, tbl *[32]uint64) int
//
// exp64 of 4 values at a time, the same operations in the same order as exp64 in mathf.go (each
// product and sum rounded on its own, never fused), so each lane has exp64's bits. It stops at the
// first block of 4 with a value outside [c[10], c[11]] (or a NaN) and returns how many values it
// did; the caller does that block with exp64. n is a multiple of 4.
TEXT ·expBlocks(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ c+24(FP), DX
	MOVQ tbl+32(FP), R8
	XORQ AX, AX
	VBROADCASTSD 0(DX), Y8   // 32·log2e
	VBROADCASTSD 8(DX), Y9   // 0.5
	VBROADCASTSD 16(DX), Y10 // ln2Hi/32
	VBROADCASTSD 24(DX), Y11 // ln2Lo/32
	VBROADCASTSD 80(DX), Y12 // lowest value done here
	VBROADCASTSD 88(DX), Y13 // highest
	VBROADCASTSD 72(DX), Y14 // 1
	MOVQ $1023, R9
	MOVQ R9, X15
	VPBROADCASTQ X15, Y15
	MOVL $31, R9
	MOVL R9, X7
	VPBROADCASTD X7, X7

loop:
	CMPQ AX, CX
	JGE done
	VMOVUPD (SI)(AX*8), Y0
	VCMPPD $13, Y12, Y0, Y1 // x >= lo (false for NaN)
	VCMPPD $2, Y13, Y0, Y2  // x <= hi
	VANDPD Y2, Y1, Y1
	VMOVMSKPD Y1, R10
	CMPQ R10, $15
	JNE done

	VMULPD Y8, Y0, Y1       // x·(32·log2e)
	VADDPD Y9, Y1, Y1       // + 0.5
	VROUNDPD $1, Y1, Y1     // n = floor
	VMULPD Y10, Y1, Y2      // n·(ln2Hi/32)
	VSUBPD Y2, Y0, Y2       // x − that
	VMULPD Y11, Y1, Y3      // n·(ln2Lo/32)
	VSUBPD Y3, Y2, Y2       // r
	VBROADCASTSD 32(DX), Y3 // 1/720
	VMULPD Y3, Y2, Y3       // p = r/720
	VBROADCASTSD 40(DX), Y4 // 1/120
	VADDPD Y4, Y3, Y3
	VMULPD Y3, Y2, Y3
	VBROADCASTSD 48(DX), Y4 // 1/24
	VADDPD Y4, Y3, Y3
	VMULPD Y3, Y2, Y3
	VBROADCASTSD 56(DX), Y4 // 1/6
	VADDPD Y4, Y3, Y3
	VMULPD Y3, Y2, Y3
	VBROADCASTSD 64(DX), Y4 // 0.5
	VADDPD Y4, Y3, Y3
	VMULPD Y3, Y2, Y3
	VADDPD Y14, Y3, Y3      // p + 1
	VMULPD Y3, Y2, Y3       // p = r·(p + 1)
	VADDPD Y14, Y3, Y3      // p + 1, the factor of the table value

	VCVTPD2DQY Y1, X4       // ni (n is a whole number: exact)
	VPAND X7, X4, X5        // ni & 31
	VPCMPEQD Y6, Y6, Y6
	VXORPD Y2, Y2, Y2
	VGATHERDPD Y6, (R8)(X5*8), Y2 // 2^(j/32)
	VMULPD Y3, Y2, Y2
	VPSRAD $5, X4, X4       // k = ni >> 5
	VPMOVSXDQ X4, Y4
	VPADDQ Y15, Y4, Y4
	VPSLLQ $52, Y4, Y4      // 2^k
	VMULPD Y4, Y2, Y2
	VMOVUPD Y2, (DI)(AX*8)
	ADDQ $4, AX
	JMP loop

done:
	VZEROUPPER
	MOVQ AX, ret+40(FP)
	RET
