from lazarus.trainer.gpt.train import main

main()
