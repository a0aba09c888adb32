//go:build race

package host

// raceEnabled: the race detector's runtime needs far more memory than a sandbox child's
// memory_mb budget in these tests, and it inflates the host's resident memory.
const raceEnabled = true
