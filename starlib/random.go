package starlib

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"sync"

	"go.starlark.net/starlark"
	"go.starlark.net/starlarkstruct"
)

// Random is @slimen//random.star: random numbers from the rollout's own generator, seeded by the
// host per run seed, step and task, so a rerun with the same seed draws the same numbers.
var Random = &starlarkstruct.Module{
	Name: "random",
	Members: starlark.StringDict{
		"random":  starlark.NewBuiltin("random.random", randomRandom),
		"uniform": starlark.NewBuiltin("random.uniform", randomUniform),
		"gauss":   starlark.NewBuiltin("random.gauss", randomGauss),
		"randint": starlark.NewBuiltin("random.randint", randomRandint),
		"choice":  starlark.NewBuiltin("random.choice", randomChoice),
		"shuffle": starlark.NewBuiltin("random.shuffle", randomShuffle),
		"sample":  starlark.NewBuiltin("random.sample", randomSample),
	},
}

const randomLocal = "slimen.starlib.random" // thread-local key of a *threadRand

// threadRand is one thread's generator. The mutex guards against a host that lets a thread's
// built-ins run from several goroutines; Starlark itself never does.
type threadRand struct {
	mu   sync.Mutex
	seed uint64
	r    *rand.Rand
}

// randStream separates slimen's PCG stream from other users of the same seed.
const randStream = 0x736c696d656e // "slimen"

// SetRandom gives a thread its generator. The host calls it for every rollout thread with a seed
// from TaskSeed; random.star and the tie-break of vote.majority draw from it.
func SetRandom(thread *starlark.Thread, seed uint64) {
	thread.SetLocal(randomLocal, &threadRand{seed: seed, r: rand.New(rand.NewPCG(seed, randStream))})
}

// ForkRandom gives child (a thread of parallel()) a generator seeded from the parent's seed and the
// child's index, so children draw the same numbers however they are scheduled and the parent's
// own sequence is untouched. A parent without a generator leaves the child without one.
func ForkRandom(parent, child *starlark.Thread, index int) {
	if p, ok := randomOf(parent); ok {
		SetRandom(child, mix(p.seed, uint64(index)+1))
	}
}

// TaskSeed derives a rollout thread's seed from the run seed, the step and the task id: stable
// across runs and platforms, and different for any change of the three.
func TaskSeed(runSeed int64, step int, taskID string) uint64 {
	h := fnv.New64a()
	var buf [16]byte
	binary.LittleEndian.PutUint64(buf[:8], uint64(runSeed))
	binary.LittleEndian.PutUint64(buf[8:], uint64(step))
	h.Write(buf[:])
	h.Write([]byte(taskID))
	return mix(h.Sum64(), 0)
}

// mix is SplitMix64's finaliser over a+b·golden: neighbouring inputs give unrelated seeds.
func mix(a, b uint64) uint64 {
	z := a + (b+1)*0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// randomOf returns the generator the host gave thread, if any.
func randomOf(thread *starlark.Thread) (*threadRand, bool) {
	r, ok := thread.Local(randomLocal).(*threadRand)
	return r, ok
}

// threadRandom returns the thread's generator, or an error naming fn when the host set none.
func threadRandom(thread *starlark.Thread, fn string) (*threadRand, error) {
	if r, ok := randomOf(thread); ok {
		return r, nil
	}
	return nil, fmt.Errorf("%s: this thread has no random generator; random numbers are seeded per rollout, "+
		"so call it from rollout(task), not at the top level of a file", fn)
}

// float64 draws a number in [0, 1), locking the generator only for its own use.
func (t *threadRand) float64() float64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.r.Float64()
}

// norm draws from the standard normal distribution, locking the generator as float64 does.
func (t *threadRand) norm() float64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.r.NormFloat64()
}

// intN returns a uniform integer in [0, n), n > 0.
func (t *threadRand) intN(n uint64) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.r.Uint64N(n)
}

// shuffle permutes xs in place (Fisher–Yates).
func (t *threadRand) shuffle(xs []starlark.Value) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.r.Shuffle(len(xs), func(i, j int) { xs[i], xs[j] = xs[j], xs[i] })
}

// sample returns k of xs in random order, each position at most once; it shuffles only the first
// k places, so drawing a few from a long list is cheap.
func (t *threadRand) sample(xs []starlark.Value, k int) []starlark.Value {
	out := append([]starlark.Value(nil), xs...)
	t.mu.Lock()
	defer t.mu.Unlock()
	for i := range k {
		j := i + t.r.IntN(len(out)-i)
		out[i], out[j] = out[j], out[i]
	}
	return out[:k]
}

func randomRandom(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	if err := starlark.UnpackArgs(b.Name(), args, kwargs); err != nil {
		return nil, err
	}
	r, err := threadRandom(thread, b.Name())
	if err != nil {
		return nil, err
	}
	return starlark.Float(r.float64()), nil
}

func randomUniform(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var lo, hi number
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "a", &lo, "b", &hi); err != nil {
		return nil, err
	}
	r, err := threadRandom(thread, b.Name())
	if err != nil {
		return nil, err
	}
	return starlark.Float(float64(lo) + float64(hi-lo)*r.float64()), nil
}

func randomGauss(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	mu, sigma := number(0), number(1)
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "mu?", &mu, "sigma?", &sigma); err != nil {
		return nil, err
	}
	if sigma < 0 {
		return nil, fmt.Errorf("%s: for parameter sigma: got %g, want ≥ 0", b.Name(), float64(sigma))
	}
	r, err := threadRandom(thread, b.Name())
	if err != nil {
		return nil, err
	}
	return starlark.Float(float64(mu) + float64(sigma)*r.norm()), nil
}

// randomRandint returns an integer in [a, b], both ends included, as Python's does.
func randomRandint(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var lo, hi int64
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "a", &lo, "b", &hi); err != nil {
		return nil, err
	}
	if lo > hi {
		return nil, fmt.Errorf("%s: empty range: a=%d is greater than b=%d", b.Name(), lo, hi)
	}
	span := uint64(hi) - uint64(lo) + 1 // wraps to 0 only for the full int64 range
	r, err := threadRandom(thread, b.Name())
	if err != nil {
		return nil, err
	}
	if span == 0 {
		r.mu.Lock()
		defer r.mu.Unlock()
		return starlark.MakeInt64(int64(r.r.Uint64())), nil
	}
	return starlark.MakeInt64(int64(uint64(lo) + r.intN(span))), nil
}

func randomChoice(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var v starlark.Value
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "seq", &v); err != nil {
		return nil, err
	}
	seq, ok := v.(starlark.Indexable)
	if !ok {
		return nil, fmt.Errorf("%s: for parameter seq: got %s, want list, tuple or string", b.Name(), v.Type())
	}
	if seq.Len() == 0 {
		return nil, fmt.Errorf("%s: cannot choose from an empty %s", b.Name(), seq.Type())
	}
	r, err := threadRandom(thread, b.Name())
	if err != nil {
		return nil, err
	}
	return seq.Index(int(r.intN(uint64(seq.Len())))), nil
}

// randomShuffle returns a new list rather than shuffling in place, so it works on tuples and on
// frozen lists (every global is frozen once the file has run).
func randomShuffle(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var xs starlark.Iterable
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "xs", &xs); err != nil {
		return nil, err
	}
	r, err := threadRandom(thread, b.Name())
	if err != nil {
		return nil, err
	}
	vals := collect(xs)
	r.shuffle(vals)
	return starlark.NewList(vals), nil
}

func randomSample(thread *starlark.Thread, b *starlark.Builtin, args starlark.Tuple, kwargs []starlark.Tuple) (starlark.Value, error) {
	var (
		xs starlark.Iterable
		k  int
	)
	if err := starlark.UnpackArgs(b.Name(), args, kwargs, "xs", &xs, "k", &k); err != nil {
		return nil, err
	}
	vals := collect(xs)
	if k < 0 || k > len(vals) {
		return nil, fmt.Errorf("%s: for parameter k: got %d, want 0 ≤ k ≤ %d (the number of items)", b.Name(), k, len(vals))
	}
	r, err := threadRandom(thread, b.Name())
	if err != nil {
		return nil, err
	}
	return starlark.NewList(r.sample(vals, k)), nil
}
