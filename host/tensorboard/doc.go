// Package tensorboard writes TensorBoard event files from Go: scalars, histograms and text
// (the text plugin's summaries), in the TFRecord framing of protobuf Event messages that
// TensorBoard's own reader loads. It needs neither TensorFlow nor generated protobuf code: the
// few messages it writes are encoded by hand with protowire.
package tensorboard
