package tensorboard

import (
	"encoding/binary"
	"hash/crc32"
)

// This file defines the TFRecord framing: each record is its length (uint64, little-endian), the
// masked CRC32-C of those 8 bytes, the data, and the masked CRC32-C of the data.

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// maskedCRC is TFRecord's masked CRC32-C of b: rotated right by 15 bits, plus a constant, so a
// CRC of data that holds CRCs is not itself trivially a CRC.
func maskedCRC(b []byte) uint32 {
	c := crc32.Checksum(b, castagnoli)
	return (c>>15 | c<<17) + 0xa282ead8
}

// appendRecord appends data framed as one TFRecord to b.
func appendRecord(b, data []byte) []byte {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(data)))
	b = append(b, n[:]...)
	b = binary.LittleEndian.AppendUint32(b, maskedCRC(n[:]))
	b = append(b, data...)
	return binary.LittleEndian.AppendUint32(b, maskedCRC(data))
}
